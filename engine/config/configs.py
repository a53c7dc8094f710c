"""Every setting of a training run: one typed config per concern, made from the command line
(engine/config/arguments.py), completed once by engine/config/resolve.py, read-only after
(every config is a frozen dataclass)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config.checkpointing import CheckpointConfig
from engine.config.data import DataConfig
from engine.config.evaluation import EvalConfig
from engine.config.exits import ExitConfig
from engine.config.fim import FimConfig
from engine.config.logs import LoggingConfig
from engine.config.megatron.compat import MegatronFlags
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.config.parallel import ParallelConfig
from engine.config.profiling import ProfileConfig
from engine.config.resilience import ResilienceConfig
from engine.config.runtime import RuntimeConfig
from engine.config.tokenizer import TokenizerConfig
from engine.config.training import TrainingConfig


@dataclass(frozen=True)
class Configs:
    """A training run's configs; `given` holds the flags its command line named."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    fim: FimConfig = field(default_factory=FimConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    profiling: ProfileConfig = field(default_factory=ProfileConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    megatron: MegatronFlags = field(default_factory=MegatronFlags)
    given: frozenset[str] = frozenset()


# (Configs field, its config class, its group's title in --help), in --help's order
SECTIONS = (
    ("model", ModelConfig, "model"),
    ("parallel", ParallelConfig, "parallelism"),
    ("optimizer", OptimizerConfig, "optimizer, learning rate, loss scaling"),
    ("data", DataConfig, "data"),
    ("fim", FimConfig, "fill-in-the-middle data"),
    ("training", TrainingConfig, "training length and batch"),
    ("runtime", RuntimeConfig, "device, precision and kernels"),
    ("evaluation", EvalConfig, "evaluation"),
    ("logging", LoggingConfig, "logging"),
    ("checkpointing", CheckpointConfig, "checkpoints"),
    ("exit", ExitConfig, "exit conditions and skipped steps"),
    ("resilience", ResilienceConfig, "hangs, reruns and stragglers"),
    ("profiling", ProfileConfig, "profiling"),
    ("tokenizer", TokenizerConfig, "tokenizer"),
    ("megatron", MegatronFlags, "Megatron-LM flags without effect here, or refused"),
)


def configs_from(parsed: dict[type, object], given: frozenset[str]) -> Configs:
    """Configs from engine/config/arguments.py's {class: instance}."""
    return Configs(**{name: parsed[cls] for name, cls, _ in SECTIONS}, given=given)
