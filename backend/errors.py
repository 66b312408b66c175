"""`ConfigError`: an engine option or a model's config is invalid (the message names the option). Its own module,
below every other, so that each config module (config.py, speculative_config.py) raises it without importing another."""


class ConfigError(ValueError):
    pass
