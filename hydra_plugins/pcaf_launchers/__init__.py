"""The suite's Hydra launchers, ``hydra/launcher=local`` and ``hydra/launcher=slurm``: Hydra's submitit launchers
(jobs, resources, requeueing as the plugin has them) whose sweeps report an ``sbatch`` that refuses and a job that
dies in one line each and go on to their summary, instead of ending in submitit's traceback.

The work is :func:`experiments.sweep_jobs.launch`; this package only puts the classes where Hydra looks for
launchers (the ``hydra_plugins`` namespace, scanned at start-up). Without the ``cluster`` extra there is nothing to
register, and a command that asks for these launchers is told in one line to install it
(:func:`experiments.cluster.require_extra`).
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # no cluster extra: no launcher classes here for Hydra's scan to find
    LocalLauncher = SlurmLauncher = None


class _SuiteReports:
    """The launch of the suite's launchers: :func:`experiments.sweep_jobs.launch` over the plugin's job call."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from experiments.sweep_jobs import launch

        return launch(self, job_overrides, initial_job_idx)


if LocalLauncher is not None:

    class SweepLocalLauncher(_SuiteReports, LocalLauncher):
        """Every job of a sweep in its own process on this machine (submitit's local executor)."""

    class SweepSlurmLauncher(_SuiteReports, SlurmLauncher):
        """Every batch of a sweep as one Slurm job array, submitted with ``sbatch``."""
