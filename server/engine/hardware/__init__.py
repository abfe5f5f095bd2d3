"""The machine: devices and their profiles, memory readings, the CPU threads we may use."""
