"""The configuration: its model (`schema`, each section's keys and checks; `rules`, the alert
rules), the checks across sections (`checks`), and loading a file (`load`: environment
references, secrets, warnings).
"""
