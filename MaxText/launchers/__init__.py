"""Launchers behind multihost_job.py: one module per cluster manager, and what they share."""

import yaml


class _BlockDumper(yaml.SafeDumper):
  """Multi-line strings (startup and container scripts) as readable YAML `|` blocks; no &anchors."""

  def ignore_aliases(self, data):
    return True


_BlockDumper.add_representer(
  str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def to_yaml(doc: dict) -> str:
  """A job spec or manifest as YAML, keys in the order written, scripts as `|` blocks."""
  return yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False, width=1000)
