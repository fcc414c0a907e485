"""Compatibility: publishers live in outboxpg.relay.publishers (``--publisher
outboxpg.publishers:print_event`` keeps working)."""

from outboxpg.relay.publishers import (
    FunctionPublisher,
    NotSent,
    PermanentError,
    Publisher,
    PublisherNotFound,
    as_publisher,
    load_publisher,
    print_event,
)

__all__ = ["FunctionPublisher", "NotSent", "PermanentError", "Publisher", "PublisherNotFound", "as_publisher",
           "load_publisher", "print_event"]
