"""What the tests and the benches share: free ports, the mesh as processes, a PostgreSQL server,
scripted upstreams, replay records. Production never imports it."""
