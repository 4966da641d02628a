"""The error of the input pipeline that a user's input causes (a file, dataset, column or tokenizer that
cannot be used as named); its message names the file or key and what to change. launch.py turns it into
one line on stderr. A ValueError, so callers that caught ValueError from the data modules still do."""


class DataError(ValueError):
  """A dataset, data file or tokenizer the config names cannot be read or used; the message says how to fix it."""
