"""The one error of the layout rules (dims.py, stages.py, plan.py): a layout that cannot work. Its message names the
flag to change and the numbers; ``config.arguments.validate`` turns it into its ``ConfigError`` line."""


class LayoutError(ValueError):
    """A parallel size, batch, layer split or sequence split that cannot work; the message names the flag."""
