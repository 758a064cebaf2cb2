"""The names the command line and the config give log levels and formats, and what a secret is
shown as: apart from `exporter.core.logs`, so that the commands reading them (`--help`, `check`,
`rules`) start without the logging package."""

MASK = "***"
LEVELS = {"debug": "debug", "info": "info", "warn": "warning", "warning": "warning", "error": "error"}
"""Log levels as `--log.level` (promlog's spelling: `warn`) and the config's `log.level` (`warning`) name them."""
FORMATS = {"logfmt": "text", "text": "text", "json": "json"}
"""Log formats as `--log.format` (`logfmt`) and the config's `log.format` (`text`) name them."""
