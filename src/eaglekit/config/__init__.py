"""The run config: one YAML file, validated by pydantic, one section per stage. Each section is in the module of its
name (``extract`` in extract.py; ``train.draft`` and ``train.ttt`` in draft.py and ttt.py), ``run`` holds the whole
file and its loading, ``base`` what the sections share. The rest of eaglekit imports these names from here."""

from eaglekit.config.base import (
    DTYPE_ALIASES,
    INT64_LIMIT,
    SEED_LIMIT,
    ConfigDeprecation,
    DtypeAlias,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Section,
    Seed,
    ServerPoolConfig,
    line_of_key,
    move_old_spellings,
)
from eaglekit.config.data import DataConfig
from eaglekit.config.draft import (
    AUTO,
    AUTO_WINDOW,
    DEFAULT_ARCHITECTURE,
    DRAFT_KEYS,
    DRAFT_MODELS,
    DFlash2Draft,
    DFlashDraft,
    DraftConfig,
    DraftSection,
    DSparkDraft,
    Eagle3Draft,
    LlamaDraft,
    MlaDraft,
    PEagleDraft,
    WindowSetting,
    every_draft_key,
)
from eaglekit.config.evaluate import EvaluateConfig, SuiteConfig
from eaglekit.config.export import ExportConfig, ExportForm
from eaglekit.config.extract import ExtractConfig, FeatureStreamConfig, MooncakeStoreConfig, VllmFeaturesConfig
from eaglekit.config.generate import GenerateConfig
from eaglekit.config.paths import PATH, PATH_OR_HUB_ID, TEMPLATE_OR_PATH, ConfigPath
from eaglekit.config.preflight import PreflightConfig
from eaglekit.config.prepare import PrepareConfig
from eaglekit.config.run import RunConfig, load_config, parse_config
from eaglekit.config.target import TargetConfig
from eaglekit.config.train import TTT_MOVED, TrainConfig, move_old_train_spellings
from eaglekit.config.ttt import TTT_ONLY_KEYS, StepWeights, TTTConfig
from eaglekit.config.verify import VerifyConfig
from eaglekit.config.vocab import VocabConfig

__all__ = [
    # loading
    "RunConfig",
    "load_config",
    "parse_config",
    # the sections, in the file's order
    "TargetConfig",
    "DataConfig",
    "GenerateConfig",
    "PrepareConfig",
    "VocabConfig",
    "ExtractConfig",
    "VllmFeaturesConfig",
    "FeatureStreamConfig",
    "MooncakeStoreConfig",
    "TrainConfig",
    "TTTConfig",
    "StepWeights",
    "TTT_MOVED",
    "TTT_ONLY_KEYS",
    "move_old_train_spellings",
    "DraftConfig",
    "DraftSection",
    "Eagle3Draft",
    "LlamaDraft",
    "MlaDraft",
    "PEagleDraft",
    "DFlashDraft",
    "DSparkDraft",
    "DFlash2Draft",
    "DRAFT_MODELS",
    "DRAFT_KEYS",
    "DEFAULT_ARCHITECTURE",
    "AUTO",
    "AUTO_WINDOW",
    "WindowSetting",
    "every_draft_key",
    "EvaluateConfig",
    "SuiteConfig",
    "ExportConfig",
    "ExportForm",
    "VerifyConfig",
    "PreflightConfig",
    # what the sections share
    "Section",
    "ServerPoolConfig",
    "DTYPE_ALIASES",
    "DtypeAlias",
    "Seed",
    "SEED_LIMIT",
    "INT64_LIMIT",
    "NonNegativeInt",
    "PositiveInt",
    "NonNegativeFloat",
    "ConfigPath",
    "PATH",
    "PATH_OR_HUB_ID",
    "TEMPLATE_OR_PATH",
    "ConfigDeprecation",
    "line_of_key",
    "move_old_spellings",
]
