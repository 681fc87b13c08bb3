// The camera for video mode: a live preview in a <video> element and, on demand, the
// current picture as a JPEG of bounded size (the model takes about one frame a second).

/** JPEG settings: width in pixels (height follows the aspect ratio) and quality. */
export const FRAME_MAX_WIDTH = 640;
export const FRAME_QUALITY = 0.7;
/** A frame larger than this is encoded again at a lower quality. */
export const FRAME_MAX_BYTES = 256 * 1024;

export class Camera {
  constructor(video) {
    this.video = video; // the preview element
    this.stream = null;
    this.canvas = document.createElement('canvas');
  }

  /** Ask for the camera and show it; rejects with the getUserMedia error. */
  async start() {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      throw Object.assign(new Error('this browser has no getUserMedia'), {
        name: window.isSecureContext ? 'NotSupportedError' : 'InsecureContext',
      });
    }
    this.stream = await navigator.mediaDevices.getUserMedia({
      video: { width: { ideal: FRAME_MAX_WIDTH }, height: { ideal: 480 }, frameRate: { ideal: 15 } },
    });
    this.video.srcObject = this.stream;
    this.video.muted = true;
    // play() may be refused until the element is visible; the preview is only cosmetic.
    await this.video.play().catch(() => {});
  }

  /** The current picture as JPEG bytes, or null when no picture is available yet. */
  async grabJpeg(maxWidth = FRAME_MAX_WIDTH, quality = FRAME_QUALITY) {
    const { videoWidth, videoHeight } = this.video;
    if (!this.stream || !videoWidth || !videoHeight) return null;
    const scale = Math.min(1, maxWidth / videoWidth);
    this.canvas.width = Math.round(videoWidth * scale);
    this.canvas.height = Math.round(videoHeight * scale);
    this.canvas.getContext('2d').drawImage(this.video, 0, 0, this.canvas.width, this.canvas.height);
    let blob = await this._encode(quality);
    if (blob && blob.size > FRAME_MAX_BYTES) blob = await this._encode(quality / 2);
    if (!blob || blob.size > FRAME_MAX_BYTES) return null;
    return new Uint8Array(await blob.arrayBuffer());
  }

  /** Stop the camera and clear the preview. */
  stop() {
    if (this.stream) {
      for (const track of this.stream.getTracks()) track.stop();
      this.stream = null;
    }
    this.video.srcObject = null;
  }

  _encode(quality) {
    return new Promise((resolve) => this.canvas.toBlob(resolve, 'image/jpeg', quality));
  }
}
