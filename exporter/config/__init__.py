"""The configuration: its model (`schema`, each section's keys and checks) and loading a file
(`load`: environment references, secrets, warnings).
"""
