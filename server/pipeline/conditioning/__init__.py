"""What steers a request's rows besides its prompt: LoRA adapters per row (and their files, and
changes while serving), ControlNets, and image edits."""
