package client

import (
	"context"
	"fmt"
	"net"
	"strconv"

	"github.com/expertd/expertd/shard"
)

// StatefulSetAddrs are the addresses of the shards of a sharded
// deployment (the Helm chart's sharded mode): replica i of StatefulSet set
// is shard i, and Kubernetes names it set-i under the StatefulSet's
// headless service, so the addresses are
// "set-0.<service>:port", "set-1.<service>:port", ... Pass service
// qualified as far as the caller's DNS search path needs, e.g.
// "expertd-headless.models.svc.cluster.local". gRPC resolves each name by
// DNS when it connects and again when a pod is rescheduled.
func StatefulSetAddrs(set, service string, port, replicas int) []string {
	addrs := make([]string, replicas)
	for i := range addrs {
		addrs[i] = net.JoinHostPort(set+"-"+strconv.Itoa(i)+"."+service, strconv.Itoa(port))
	}
	return addrs
}

// DialStatefulSet is DialSharded on the shards of StatefulSet set behind
// headless service (see StatefulSetAddrs), one shard per replica of m.
func DialStatefulSet(ctx context.Context, m *shard.Map, set, service string, port int, opts ...Option) (*Sharded, error) {
	if m == nil {
		return nil, fmt.Errorf("expertd sharded client: no shard map")
	}
	return DialSharded(ctx, m, StatefulSetAddrs(set, service, port, m.NumShards()), opts...)
}
