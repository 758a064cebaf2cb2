"""The HTTP server (hardened: deadlines, a connection cap, TLS, basic auth), its JSON views and
the landing page with its chart.
"""
