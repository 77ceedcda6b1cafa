// Command etcd is upstream's etcd server, built from the go.etcd.io/etcd/server/v3 release pinned
// in this module's go.mod (see ../../README.md). Its body is what upstream's server/main.go does:
// run etcdmain.Main.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
