// An empty stand-in for the module github.com/tencentcloud/tencentcloud-sdk-go/tencentcloud/vpc,
// which flannel v0.28.10's go.mod requires at a version the Go module proxy
// does not serve. With it replaced by this, Go finds the package flannel's
// tencent-vpc backend imports (vpc/v20170312) in the monolithic
// tencentcloud-sdk-go module, which the proxy serves. The benchmark uses
// flannel's udp and vxlan backends only.
module github.com/tencentcloud/tencentcloud-sdk-go/tencentcloud/vpc

go 1.21
