"""Slack's mrkdwn: names from the API escaped, texts capped at Slack's limits.

Slack reads `<!channel>`, `<https://…|label>` and `<@user>` in any mrkdwn text, the message's
top-level `text` included, so every name that comes from the API (an endpoint, an item, a
model, a summary made of them) is escaped before it goes into one. A text over a limit is cut
where it cannot split an escape in two, and says so with "…".
"""

from __future__ import annotations

TEXT = 3000
"""The longest text of a section or context block, and the longest top-level `text` we send."""
HEADER = 150
"""The longest plain text of a header block."""


def escape(value: str) -> str:
    """Slack's three escapes: the text shows as written, never as a mention, a link or a command."""
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def cap(text: str, limit: int = TEXT) -> str:
    """`text` if it fits, else its start and "…" within `limit` characters, never ending inside an
    escape (`&amp;` cut to `&am` would show as written)."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    amp = cut.rfind("&", max(0, len(cut) - 4))
    if amp != -1 and ";" not in cut[amp:]:
        cut = cut[:amp]
    return cut + "…"
