"""A backend whose target raises: the runner must forward the traceback."""


def target(chan, start):
    raise ValueError("target exploded on purpose")


def reader(chan, start):
    chan.expect("peer")
