"""The files dtrain writes and reads, without torch: their names, the run directory's store
(markers, digests, rotation) on a disk or in an object store, metrics.jsonl, runs.csv, sweep
folders, and outputs written so that a failure leaves what was there."""
