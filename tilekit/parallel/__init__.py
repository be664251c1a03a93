"""Tensor parallelism: one model split across the GPUs of a host, one process (rank) per GPU, in the Megatron /
gpt-fast manner (column-parallel in, row-parallel out, a vocabulary-split LM head).

    splits.py       each rank's share of heads, columns, vocabulary rows; the parts of a tensor a rank holds
    comm.py         Communicator (sums over the ranks), ShapeOnly (a dry run's), ThreadGroup (threads: CPU tests)
    nccl.py         NcclCommunicator, through CuPy's NCCL binding
    peer.py         PeerMemory: small all-reduces written straight into the peers' memory
    rendezvous.py   Link: the ranks' TCP rendezvous and watchdog
    launch.py       starting N ranks on this host, and where this process stands among them

Ranks find each other through torchrun's variables (tilekit.env.distributed: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so torchrun, Slurm and mpirun wrappers start them; launch() starts them itself
(`tilekit generate --tp N`). The names below are the package's interface.
"""

from tilekit.parallel.comm import Communicator, RankError, ShapeOnly, ThreadCommunicator, ThreadGroup
from tilekit.parallel.launch import free_port, launch, placement
from tilekit.parallel.nccl import NcclCommunicator, join, load_nccl, nccl_unique_id
from tilekit.parallel.peer import PeerMemory
from tilekit.parallel.rendezvous import EXIT_PEER_LOST, RENDEZVOUS_TIMEOUT, Link
from tilekit.parallel.splits import (VOCAB_GRANULE, even_span, kv_head_span, part_fields, part_problem, part_shape,
                                     span, take_part, vocab_span)

__all__ = ["Communicator", "EXIT_PEER_LOST", "Link", "NcclCommunicator", "PeerMemory", "RENDEZVOUS_TIMEOUT",
           "RankError", "ShapeOnly", "ThreadCommunicator", "ThreadGroup", "VOCAB_GRANULE", "even_span", "free_port",
           "join", "kv_head_span", "launch", "load_nccl", "nccl_unique_id", "part_fields", "part_problem",
           "part_shape", "placement", "span", "take_part", "vocab_span"]
