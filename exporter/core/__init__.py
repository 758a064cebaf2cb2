"""What every layer uses and none owns: the billing clock, logging, decimals, the config's field
types, network causes, socket deadlines (`deadline`, shared by the server, the POST client and
email), the POST client, Slack's escaping.
"""
