// Entry point of video.html: the full-duplex page with microphone and camera.
import { startDuplexPage } from './duplex-page.js';

startDuplexPage({ mode: 'video' });
