"""Noctaya's KEDA ExternalScaler: demand broadcasting, the gRPC servicer, the aggregate scaler."""
