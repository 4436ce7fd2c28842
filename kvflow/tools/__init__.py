"""Command-line tools: `kvflow` (cli), the environment check (doctor) and the NIXL benchmark."""
