"""The server's plumbing, whatever the protocol: putting the server together, its life until the
exit code, the per-RPC interceptor, who may call what, TLS, health and the status table."""
