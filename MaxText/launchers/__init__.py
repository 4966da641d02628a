"""Launchers behind multihost_job.py: one module per cluster manager."""
