"""Process-group helpers every layer above the parallel primitives shares, one job per module:

* :mod:`~zoo.distributed.joining`: join a launcher's group (or run as a world of one), refusing in one
  sentence what would fail obscurely; CPU ranks split the cores.
* :mod:`~zoo.distributed.local_rank`: this rank's place on its node, from whichever launcher started it.
* :mod:`~zoo.distributed.shared_memory`: DeepSpeed's CPU all-reduce workspaces, unlinked once mapped.
* :mod:`~zoo.distributed.data_parallel`: this DP rank's block of items, DP sums and means.
* :mod:`~zoo.distributed.host_agreement`: host-side flags on a gloo group, and work only the first
  rank does while the others wait under a timeout sized from the work.
* :mod:`~zoo.distributed.build_once`: a file built once per filesystem (an exclusive lock file beside
  it), the other processes waiting for it, bounded.
* :mod:`~zoo.distributed.roll_call`: after a collective failed, the ranks that never came.
* :mod:`~zoo.distributed.extension_locks`: build locks of DeepSpeed's JIT-compiled ops left by a killed
  builder, removed before DeepSpeed would wait on them forever.
* :mod:`zoo.parallel.agreement` (re-exported here): a failure on one rank raised on every rank.
"""

from zoo.distributed.build_once import build_once
from zoo.distributed.data_parallel import dp_block, dp_sum, weighted_means_over_dp
from zoo.distributed.host_agreement import (
    SLOWEST_BYTES_PER_S,
    WAIT_MARGIN,
    agree_max,
    directory_bytes,
    first_rank_result,
    first_rank_timeout,
    host_group,
    run_on_every_rank,
    run_on_first_rank,
)
from zoo.distributed.joining import (
    bind_launcher_device,
    check_accelerator_matches_machine,
    check_launched,
    join_deepspeed,
    join_process_group,
    launched_distributed,
    master_port_in_use,
    master_port_named,
    process_group_left_on_success,
    share_cpu_threads,
    single_device,
    single_process_env,
    visible_nvidia_gpus,
)
from zoo.distributed.local_rank import LOCAL_RANK_VARIABLES, launcher_local_rank, local_rank_or_none
from zoo.distributed.roll_call import (
    COLLECTIVE_FAILURE_WORDS,
    default_store,
    describe_duration,
    is_collective_failure,
    loop_run_number,
    ranks_that_did_not_arrive,
)
from zoo.distributed.shared_memory import SHM_BUFFER_DIR, shared_memory_buffer_path, unlink_shared_memory_buffer
from zoo.errors import USER_ERRORS
from zoo.parallel.agreement import agreed_failure, collective_device, raise_on_any_rank

__all__ = [
    "COLLECTIVE_FAILURE_WORDS",
    "LOCAL_RANK_VARIABLES",
    "SHM_BUFFER_DIR",
    "SLOWEST_BYTES_PER_S",
    "USER_ERRORS",
    "WAIT_MARGIN",
    "agree_max",
    "agreed_failure",
    "bind_launcher_device",
    "build_once",
    "check_accelerator_matches_machine",
    "check_launched",
    "collective_device",
    "default_store",
    "describe_duration",
    "directory_bytes",
    "dp_block",
    "dp_sum",
    "first_rank_result",
    "first_rank_timeout",
    "host_group",
    "is_collective_failure",
    "join_deepspeed",
    "join_process_group",
    "launched_distributed",
    "launcher_local_rank",
    "local_rank_or_none",
    "loop_run_number",
    "master_port_in_use",
    "master_port_named",
    "process_group_left_on_success",
    "raise_on_any_rank",
    "ranks_that_did_not_arrive",
    "run_on_every_rank",
    "run_on_first_rank",
    "share_cpu_threads",
    "shared_memory_buffer_path",
    "single_device",
    "single_process_env",
    "unlink_shared_memory_buffer",
    "visible_nvidia_gpus",
    "weighted_means_over_dp",
]
