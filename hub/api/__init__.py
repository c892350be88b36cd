"""The hub's HTTP API: the node API (`node`), the operator API (`operator`) and the
request models it parses (`requests`), and the OpenAPI document of both (`openapi`)."""
