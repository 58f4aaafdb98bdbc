"""The live engine dashboard: ``GET /dashboard`` (one self-contained HTML page, no external assets) and
``GET /dashboard/events`` (Server-Sent Events), fed by the engine core's typed per-step stats.

See :mod:`tinyvllm.entrypoints.dashboard.hub` for what is collected and sent.
"""

from tinyvllm.entrypoints.dashboard.routes import add_dashboard_routes
from tinyvllm.entrypoints.dashboard.hub import DashboardHub

__all__ = ["add_dashboard_routes", "DashboardHub"]
