"""Checkpoints that are never half-written, follow the order of saves, and resume a run exactly.

`checkpointer` saves and resumes a run's `Contents`: its model and optimizer, and the parts its
owner names (`parts`: `Stateful` and `ShardedStateful`, saved without knowing what they are);
`store` (in `dtrain.files`) owns the files (markers, order, rotation, the run directory's lock);
`state` knows what a checkpoint holds and how to read it safely; `load` applies one to a model
and optimizer; `digest` hashes the files as they are written and read.
"""

from dtrain.checkpoint.checkpointer import Checkpointer
from dtrain.checkpoint.load import ConfigChanged, open_checkpoint
from dtrain.checkpoint.parts import Contents, SavedPart, ShardedStateful, Stateful
from dtrain.checkpoint.state import DCP_DIR, FULL_FILE, META_FILE, POSITION, Resumed, load_file
from dtrain.files.store import LATEST, MARKER, CheckpointError, Store, read_marker

# The names other packages use.
__all__ = ["CheckpointError", "Checkpointer", "Contents", "Resumed", "ConfigChanged", "Store"]
__all__ += ["Stateful", "ShardedStateful", "SavedPart", "open_checkpoint", "load_file"]
__all__ += ["read_marker", "DCP_DIR", "FULL_FILE", "META_FILE", "LATEST", "MARKER", "POSITION"]
