"""slmrank service: model, artifact, runtimes, server."""
