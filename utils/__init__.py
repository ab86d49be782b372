"""What the training scripts share: the CIFAR-10 data path (utils.data) and the user-error type."""


class UserError(Exception):
    """A mistake in the user's input. Scripts print it as one line and exit with status 2."""
