"""Stand-in for `mlx_lm.models.deepseek_v4` where the installed mlx-lm has none (EXO main takes it
from an mlx-lm fork): the two classes EXO's cache.py imports, for its isinstance checks and
annotations. The tests' models never create one."""


class DeepseekV4Cache:
    pass


class _CompressorBranch:
    pass
