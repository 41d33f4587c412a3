"""Process launching: how a stage's engine command becomes running processes.

spec.py (launcher specs and the failures a stage raises: a leaf), run.py (the local,
local-multi, slurm and command launchers; `run_child`), gang.py (supervising a stage's ranks
as one gang: output, stop, exit causes), ray_launcher.py (the `ray` launcher, loaded only for
`kind: ray`). Nothing is imported here, so each module's own imports are what a cycle check
sees."""
