"""What every layer uses and none owns: the billing clock, logging, decimals, network causes, the
POST client, Slack's escaping.
"""
