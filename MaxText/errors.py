"""The errors a user's input causes, each with a message that says what to change.

The bottom of the import graph: it imports nothing from MaxText, so any module can raise these without
importing the module that defines the concept (config_checks raises ConfigError without importing config).
launch.py turns ConfigError and DataError into one line on stderr ("Config error: ...", "Data error: ...");
train.py does the same for CheckpointError, launch.py for DistributedInitError. Import them from here only
(imports_test checks it).
"""


class ConfigError(ValueError):
  """A configuration that cannot be run; the message says what to change."""


class ListedConfigError(ConfigError):
  """A ConfigError whose first line says what to change and whose further lines list what the user needs in
  full (every setting a compiled step differs in): the one-line exit prints them all, not the first line only."""


class DataError(ValueError):
  """A dataset, data file or tokenizer the config names cannot be read or used; the message says how to fix it.

  A ValueError, so callers that caught ValueError from the data modules still do."""


class CheckpointError(RuntimeError):
  """A checkpoint could not be saved or restored; the message is one line saying what to do."""


class DistributedInitError(RuntimeError):
  """The processes could not form a job (coordinator unreachable, timeout, bad environment)."""


class StorageError(OSError):
  """A path the config names cannot be reached, listed or written; the message names it and what to check."""
