"""What a one-line message can quote of an exception.

Here, below data/, model/ and training/, so that all three quote exceptions the same way: model/
and data/ do not import training/, and this module imports nothing.
"""


def first_line(error: BaseException, limit: int = 160) -> str:
    """An exception's message cut to its first line and to `limit` characters (its type's name
    when the message is empty): torch's and the hub's messages run over many lines."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__
