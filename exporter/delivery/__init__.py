"""Getting notifications out: the dispatcher's workers, the outbox it takes them from, retries,
and the counters of what was sent, failed and discarded.
"""
