"""The CLI's stages: each module has `run(cfg) -> dict` (tests call it directly with a composed config)."""
