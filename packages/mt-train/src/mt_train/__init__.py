"""mt-train: the moetrain training loop, checkpoints and command line (`mt-train`)."""

from mt_train.config import CheckpointConfig, DataConfig, JobConfig, ParallelConfig, TrainingConfig

__all__ = ["CheckpointConfig", "DataConfig", "JobConfig", "ParallelConfig", "TrainingConfig"]
