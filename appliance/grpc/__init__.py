"""The gRPC API (kovenlab.edge.v1.Inference): a door onto the LAN API's services."""
