"""The HTTP server and what it serves: the server and its handler (`server`), its open connections with their cap
and deadlines (`connections`), its TLS certificate, basic auth and headers (`credentials`; from the config, or
from a web configuration file in exporter-toolkit's format: `webconfig`), the strict reading of a request
(`parsing`), the routes (`routes`), the view and its JSON documents (`views`), the landing page (`page`) and its
chart (`chart`).
"""

from exporter.web.connections import HEADER_DEADLINE, IDLE_DEADLINE, MAX_CONNECTIONS, connection_cap
from exporter.web.credentials import Credentials, TlsError
from exporter.web.page import landing_page
from exporter.web.parsing import accepts_gzip, header_problem, target_path
from exporter.web.routes import OPEN_PATHS
from exporter.web.server import ExporterServer
from exporter.web.views import View, alerts_document, ready
from exporter.web.webconfig import WebConfigError

__all__ = [
    "HEADER_DEADLINE",
    "IDLE_DEADLINE",
    "MAX_CONNECTIONS",
    "OPEN_PATHS",
    "Credentials",
    "ExporterServer",
    "TlsError",
    "View",
    "WebConfigError",
    "accepts_gzip",
    "alerts_document",
    "connection_cap",
    "header_problem",
    "landing_page",
    "ready",
    "target_path",
]
