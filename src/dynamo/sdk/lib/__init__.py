"""The SDK's library modules under the original's import paths (``dynamo.sdk.lib.config``)."""
