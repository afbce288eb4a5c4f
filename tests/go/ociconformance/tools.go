//go:build tools

// The OCI distribution-spec conformance suite, built with `go test -c` from this module so that
// its version is pinned here (go.mod) and its sums checked (go.sum).
package tools

import _ "github.com/opencontainers/distribution-spec/conformance"
