// Command etcd is the stock etcd server (go.etcd.io/etcd/server/v3/etcdmain), built from the
// published module so the Noctaya tests can run a real API server without downloading binaries.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
