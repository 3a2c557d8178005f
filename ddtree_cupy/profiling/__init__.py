"""Interactive profiling of one rank's decode step (docs/PROFILING.md).

``ProfileSession`` loads once and times the step, a phase, a layer, a stage or one kernel against that
piece's byte / FLOP floor over ceilings measured in the same process; ``trace.write_chrome_trace`` exports
its timeline; ``cli.profile_run`` is the CLI's ``--profile``.
"""
from .ceilings import Ceilings, measure_ceilings, time_eager, time_graph  # noqa: F401
from .floors import Floor, StepFloors, expected_unique_experts  # noqa: F401
from .rank_comm import RankComm  # noqa: F401
from .session import ProfileSession, Table, Timing, load_configs  # noqa: F401
