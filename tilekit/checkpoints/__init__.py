"""Hugging Face model files, for every family: find a checkpoint (a directory or the local hub cache), open its
files safely, read config.json field by field, check safetensors headers against the tensors a model expects,
stream the tensors to the GPU in the model's dtype, and write checkpoints.

    files.py        regular files opened safely, bounded reads, JSON objects; ModelFileError
    checkpoint.py   a checkpoint directory, and finding one (a path, or the hub cache's snapshots)
    fields.py       config.json's fields, typed and range-checked; the checks family configs share
    safetensors.py  safetensors headers, checked before any data is read; a checkpoint's tensors over its shards
    plan.py         load plans: where each tensor goes (Target), tensors a file keeps in another form (Piece)
    stream.py       the data path: staging ring, copies and conversions on the device, the finite check
    load.py         a plan's tensors loaded; a model's weights by a family's rules
    layout.py       CheckpointLayout: one family's tensors in checkpoints (load, save, random weights)
    write.py        checkpoints written as transformers' save_pretrained writes them

Every file is untrusted. Reads stay inside the checkpoint directory (in a hub snapshot, also the repository's
blobs), open regular files only and are bounded; a bad file is a FileNotFoundError or a ModelFileError (a
ValueError) naming the file and the field, raised before any large allocation; names and values from files are
escaped in messages. Nothing here names a model family, and CuPy is imported only when a GPU load starts. The
names below are the package's interface.
"""

from tilekit.checkpoints.checkpoint import Checkpoint, find_checkpoint
from tilekit.checkpoints.fields import (MAX_LAYERS, MAX_SIZE, Fields, HFConfig, check_number, check_positive_ints,
                                        check_rotary_config, check_token_ids, common_fields, read_config,
                                        refuse_rope_theta, rope_fields, rotary_problem)
from tilekit.checkpoints.files import (CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, ModelFileError, RegularFile,
                                       TensorValueError, json_shown, plain_name_problem, read_json)
from tilekit.checkpoints.layout import CheckpointLayout
from tilekit.checkpoints.load import LM_HEAD, check_arrays, decoder_shapes, float_dtype, load_tensors, load_weights
from tilekit.checkpoints.plan import TARGET_DTYPES, Piece, Target, convert, listing, tensor_problems
from tilekit.checkpoints.safetensors import DTYPES, FLOATS, TensorFiles, TensorInfo, read_header
from tilekit.checkpoints.stream import CupyDevice, HostDevice, LoadStream, Progress
from tilekit.checkpoints.write import random_tensors, write_checkpoint

__all__ = ["CONFIG_NAME", "Checkpoint", "CheckpointLayout", "CupyDevice", "DTYPES", "FLOATS", "Fields", "HFConfig",
           "HostDevice", "INDEX_NAME", "LM_HEAD", "LoadStream", "MAX_LAYERS", "MAX_SIZE", "ModelFileError", "Piece",
           "Progress", "RegularFile", "TARGET_DTYPES", "Target", "TensorFiles", "TensorInfo", "TensorValueError",
           "WEIGHTS_NAME", "check_arrays", "check_number", "check_positive_ints", "check_rotary_config",
           "check_token_ids", "common_fields", "convert", "decoder_shapes", "find_checkpoint", "float_dtype",
           "json_shown", "listing", "load_tensors", "load_weights", "plain_name_problem", "random_tensors",
           "read_config", "read_header", "read_json", "refuse_rope_theta", "rope_fields", "rotary_problem",
           "tensor_problems", "write_checkpoint"]
