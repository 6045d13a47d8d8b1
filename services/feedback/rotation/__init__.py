"""Metric-driven rotation: Prometheus rules decide (deploy/prometheus/rotation.yaml), Alertmanager
delivers, this package records each decision and acts (docs/rotation.md)."""
