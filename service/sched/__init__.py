"""Scheduling policy, free of any transport: admission (lanes, fair shares, the one prediction),
the batcher, the service-time model and request costs. Imports no grpc; `verdict` and `shapes`
import no torch either, so that the front processes can use them."""
