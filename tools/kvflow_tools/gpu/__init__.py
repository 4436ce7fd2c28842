"""The GPU check: real KV bytes between two processes through kvflow and NIXL (UCX), phase by phase.

Why: what only a GPU shows (VRAM regions, CUDA IPC between processes, UCX's choice of lane,
gating a transfer on a CUDA event, device bandwidth) cannot be tested on the CPU machines the
project is built on, and a GPU machine is seldom at hand, then for minutes, with nothing
installed.  So the check runs from the checkout in one device call (``scripts/gpu-check
prepare`` here, then ``scripts/gpu-check run`` there: docs/testing.md "The GPU check"), and
leaves its findings in DIR as it goes, for a run cut off to keep what finished: results.json
(each phase's status and details), run.log, ucx.log, children.log and bandwidth.csv.
``--device cpu`` is the same run on host memory (phases C and F skipped), a dry run anywhere.

The phases, in the order they run: A the environment; B P→D transfers of scattered blocks,
byte-exact; E phase B with UCX's protocol log; G phase B with P's engine in an engine process
over the memory P's child owns (CUDA IPC on a GPU); I the integrity check on the caches'
memory; C (cuda) gating on a CUDA event and the CPU cost of waiting on one; D bandwidth against
bare NIXL agents and a torch copy; F (cuda, never fails the run) phase B with no thread bound to
the GPU.  The exit status is 0 when no phase
failed, 1 otherwise, 2 when the run was interrupted.

- `__main__`: the command line, for the parent and its children (``--role``).
- `phases`: the phases and `run_phases`, which runs them under their time limits.
- `transfer_phases`: phase B and its variants E, F, G and V, over the pair of engines C and D use too.
- `run`: the parent's output folder (`Run`) and its child processes (`Proc`).
- `child`: the children's entry points and phase A's environment report.
- `engine_child`: the engine (P or D) a child runs, and its commands.
- `process_child`: P whose engine runs in an engine process over the memory it owns (phase G).
- `raw_nixl`: the bandwidth baseline, a bare NIXL agent in each child.
- `ucx`: UCX's protocol tables read out of a child's log.
- `plan`: the geometries, transfers and time limits both sides share.
- `wheels`: the wheels the check carries to a GPU machine that cannot fetch them.
"""
