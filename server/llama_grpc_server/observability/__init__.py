"""What the server says about itself: structured logs and the engine's tick and request events
(telemetry.py), Prometheus metrics (metrics.py) and OpenTelemetry traces (tracing.py)."""
