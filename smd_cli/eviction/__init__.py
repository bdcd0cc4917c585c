"""KV-cache eviction policies. One class per file; `conf/eviction/<name>.yaml` names it with `_target_`."""

from smd_cli.attention.policy import EvictionPolicy, PrefillView, Selection

__all__ = ["EvictionPolicy", "PrefillView", "Selection"]
