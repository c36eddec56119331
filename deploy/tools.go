// Package deploy holds the Kubernetes chart's tests: helm's own lint and
// template engine render deploy/helm/expertd, and the output is decoded
// strictly with the Kubernetes API types. It is its own module so helm and
// the Kubernetes libraries stay out of the daemon's dependencies.
package deploy
