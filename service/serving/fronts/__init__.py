"""The front processes of `slmrank serve --fronts N`: the supervisor (in the engine), the front
process itself, and the shared-memory snapshot they read admission's state from. The front
process imports no torch."""
