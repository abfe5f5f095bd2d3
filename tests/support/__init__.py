"""What the tests share: tiny folders built as each published pipeline ships them, diffusers'
references, live servers (forked from one warm process), and waiting on a condition."""
