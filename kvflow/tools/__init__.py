"""Command-line tools: `kvflow` (cli), the environment check (doctor), the NIXL benchmark and
the state diagrams drawn from the transition tables (diagrams)."""
